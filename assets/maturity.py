"""The Dagster APIs this project opts into although Dagster marks them beta or preview.

Dagster warns on every use of such an API, which means on every code-location load and
in every run process. We use these deliberately (one run per checkpoint in backfills;
a check result per checkpoint partition), so exactly these warnings are filtered, by
message; any other beta or preview API still warns.
"""

import warnings

from dagster import BetaWarning, PreviewWarning

OPTED_IN = (
    (BetaWarning, r"Parameter `backfill_policy` of function `asset` is currently in beta"),
    (PreviewWarning, r"Specifying a partitions_def on an AssetCheckSpec is currently in preview"),
)


def opt_in() -> None:
    for category, message in OPTED_IN:
        warnings.filterwarnings("ignore", message=message, category=category)


opt_in()
