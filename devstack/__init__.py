"""The local stack for the demo, the tests and the benchmarks: a checkout's tools, never shipped."""
