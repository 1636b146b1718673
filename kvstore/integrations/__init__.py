"""Engine integrations.  Each submodule imports its engine; importing this package does not.

* :mod:`kvstore.integrations.vllm` - a vLLM (v1) KV connector backed by a kvstore store.
"""
