"""The embedded tiny target and prompt sets of the demo and the tests; no production package imports this."""
