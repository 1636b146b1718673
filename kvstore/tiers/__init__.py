"""The tiers around the local store: host memory in front of it (:mod:`kvstore.tiers.memory`)
and a shared remote behind it (:mod:`kvstore.remote`, through its adapter).  A tier
talks to the store only through :class:`kvstore.tiers.host.TierHost`, which the store
hands it at construction."""
