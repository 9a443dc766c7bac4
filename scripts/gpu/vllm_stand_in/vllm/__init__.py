"""A stand-in for vLLM on the GPU machine, where vLLM is not installed (scripts/gpu/checks.py,
check `vllm_worker`): only the names `kvcached.vllm`'s import and its worker half use, with vLLM
0.33's semantics where the worker reads them (a plain full-attention spec's fields and page size).
Never installed; put on `sys.path` by the check only when `import vllm` fails.
`python/tests/test_vllm_stand_in.py` checks it against the real vLLM: the same namespace and
page size for the same spec."""
