"""The referee's grid definitions: pure data (each entry a Megatron command line) and memguard's resolution of it
into worker settings. They import neither torch nor megatron and start no process, so a test that reads them stays
framework-free (tests/framework_free.py); the runners beside them (grid.py, moe_grid.py, moe_ci_layouts.py,
fsdp_grid.py) import them and run the entries."""
