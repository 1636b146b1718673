"""The vLLM connector's scheduler side: lookups and the step's loads and saves (``side``:
``SchedulerSide``), lookups on a thread pool within a wait budget (``lookup_pool``),
which blocks a step saves (``save_plan``) and whether vLLM's own prefix cache may hold KV of old weights
(``stale``).  It may import the vLLM level (:mod:`kvstore.integrations.vllm`'s config,
metadata, metrics, scope, ranks, the lookup socket and the open store), :mod:`kvstore.integrations.common` and the
public API; never the worker side or :mod:`kvstore.cuda`, not even through another
module.
"""
