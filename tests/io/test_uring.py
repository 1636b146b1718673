"""The conformance suite on the io_uring engine."""

from tests.conformance import StoreConformance


class TestUringStore(StoreConformance):
    engine = "io_uring"
