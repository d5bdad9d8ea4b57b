"""What the measuring commands (bench/, profile/) and the tests share, one of each: the models
(models), the workload a measurement trains (workload), the memory meter (memory) and the rank
spawner (ranks). It imports the product, never bench/ or profile/ (tests/python/test_layering.py).
"""
