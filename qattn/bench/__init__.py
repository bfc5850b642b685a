"""A/B benchmark harness: ``python -m qattn.bench {decode,prefill,insert}`` (see ``--help``)."""
