"""Stage 2: the hidden-state service (target model behind a narrow interface)."""
