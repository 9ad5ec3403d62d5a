"""Data parallelism: N engine replicas behind one OpenAI front end (`nanoserve serve --data-parallel-size N`).

messages.py is what the front end and a replica say to each other over one connection; replica.py is a replica's
side (an EngineHost and the loop that answers the front end); launch.py starts replicas as processes or as Ray
actors; listener.py is where replicas connect back (the authkey handshake, which no stranger on the port can hold
up); live_flags.py keeps the live flags a restarted replica takes; routing.py picks a replica for a request
(prefix affinity, then load); front.py is the front end's host (EngineHost's interface over the replicas: the
routes need not know there are several); merge.py folds the replicas' snapshots into the one /health and the
console read.
"""
