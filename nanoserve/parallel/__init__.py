"""Tensor parallelism on torch.distributed: the shard plan (shard.py), the group and its collectives (group.py),
rank 0's forward across the group (driver.py) and the other ranks' loop (worker.py)."""
