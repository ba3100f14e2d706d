"""Stage 1: raw conversations to token rows with assistant masks (Ray Data, CPU)."""
