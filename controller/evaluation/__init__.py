"""The evaluation harness: load generator, sweep, bench (one and two models), soak, tracing overhead.

It drives a tritonserver and the controller from outside, as a user's traffic and a user's choice
of config would. The product (everything else under controller/) never imports this package; the
CLI's `sweep`, `bench` and `soak` verbs import it inside their functions.
"""
