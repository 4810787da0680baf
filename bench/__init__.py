"""specdec bench: the benchmark behind `specdec bench` (bench.run) and its prompt set."""
