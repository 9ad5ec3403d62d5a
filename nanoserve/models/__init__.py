"""The architectures nanoserve runs, one file each, found through the registry (nanoserve/models/registry.py).

An architecture file says what the model is: its modules, their checkpoint names, and one forward. How this machine
runs the layers (fused CPU kernels, tensor parallel reductions, packed weights) is given to it when it is built.
"""
