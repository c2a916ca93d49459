"""``python -m ckptflow``: the ``ckptflow`` command where its console script is not on PATH
(an interpreter without the package's scripts installed, such as a GPU machine's own image)."""

from ckptflow.cli import main

raise SystemExit(main())
