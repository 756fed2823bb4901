"""Ray actors for the prefill and decode pools: workers, pool building, health, restart, migration."""
