"""The vLLM connector's scheduler side: lookups and the step's loads and saves (``side``:
``SchedulerSide``), lookups within a wait budget (``async_lookup``), which blocks a step
saves (``saves``) and whether vLLM's own prefix cache may hold KV of old weights
(``stale``).  It may import the vLLM level (:mod:`kvstore.integrations.vllm`'s config,
metadata, metrics, scope, lookup and ranks), :mod:`kvstore.integrations.common` and the
public API; never the worker side or :mod:`kvstore.cuda`, not even through another
module.
"""
