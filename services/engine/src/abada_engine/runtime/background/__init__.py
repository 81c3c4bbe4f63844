"""What runs beside the requests: periodic rounds, wake-ups from PostgreSQL, this replica's memory of what it handed out, queue upkeep."""
