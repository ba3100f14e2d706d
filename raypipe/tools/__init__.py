"""Tools beside the stages: the synthetic reference corpus that benchmarks and tests feed the data stage."""
