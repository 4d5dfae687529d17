"""The shipped policies, installed as package data (`adaptspec.policies`): give their name where
a policy is asked for (`adaptspec policy check default`, `ADAPTSPEC_POLICY=latency-first`).

- default.yaml: what `adaptspec serve` and `make serve` use;
- latency-first.yaml, throughput-first.yaml: the two ends of the trade-off;
- bench.yaml: the benchmark's policy (`adaptspec bench`).
"""
