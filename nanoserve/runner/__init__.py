"""The model runner: everything between a scheduled step and its sampled tokens.

Only this package knows how a step is computed: the KV pool's sizing and warm-up, building the batch, the decode
fast path and its captured graphs, the paged read's mode, the tensor-parallel group. The engine hands it a
SchedulerOutput and gets a StepResult back (see model_runner.py).
"""
