"""``python -m pipelines.demo`` (what `make demo` runs)."""

from pipelines.demo.cli import main

raise SystemExit(main())
