"""Engine: requests, scheduler, model runner, sampler and the step loop (vLLM-v1 style split).

The scheduler never touches tensors; the runner never decides who runs.
"""
