"""Pure decisions (retention, when to save): no store, no clock, no Dagster; tested without storage."""
