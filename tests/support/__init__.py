"""Helpers shared by the tests: one state factory (``states``), one corruption helper
(``corrupt``), fault injection (``faulty_store``), multi-process ranks (``dist_workers``),
the CLI's fixture store (``cli``) and the Dagster tests' store (``dagster``)."""
