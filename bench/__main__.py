"""``python3 -m bench``: run the benchmarks and write the Markdown report."""

from bench.cli import main

raise SystemExit(main())
