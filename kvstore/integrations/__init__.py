"""Engine integrations.  Each imports its engine; importing this package does not.

* :mod:`kvstore.integrations.vllm` - a vLLM (v1) KV connector backed by a kvstore store;
* :mod:`kvstore.integrations.sglang` - SGLang HiCache's storage backend;
* :mod:`kvstore.integrations.common` - what both do alike (the extra config, the
  weights' fingerprint, the rank stores' share of the capacity).

An integration may import the public API (``kvstore`` and its public modules),
:mod:`kvstore.codecs` and the remote tier's options; the vLLM worker side also
:mod:`kvstore.cuda`, its scheduler side never.
"""
