"""specdec bench: the benchmark behind `specdec bench compare` (bench.run) and its prompt set."""
