"""The conformance suite on the thread-pool fallback engine."""

from tests.conformance import StoreConformance


class TestThreadPoolStore(StoreConformance):
    engine = "threads"
