"""How often the lifecycle's sensors tick.

Every sensor of the code location (landing, run failures, the two automation sensors)
uses ``SENSOR_INTERVAL_S``: ``CKPTFLOW_SENSOR_INTERVAL_S`` when set (read when the code
location loads; tests shorten it this way), else ``DEFAULT_SENSOR_INTERVAL_S``. The
default is what keeps commit -> archived within a minute (docs/lifecycle.md, "Latency") while a
tick stays cheap: the landing sensor lists commit records only, and the automation
sensors evaluate conditions over what changed since their cursor.
"""

import os

SENSOR_INTERVAL_ENV = "CKPTFLOW_SENSOR_INTERVAL_S"
DEFAULT_SENSOR_INTERVAL_S = 15


def sensor_interval_s() -> int:
    text = os.environ.get(SENSOR_INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_SENSOR_INTERVAL_S
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{SENSOR_INTERVAL_ENV}={text!r} must be a whole number of seconds, at least 1")
    return value


SENSOR_INTERVAL_S = sensor_interval_s()
