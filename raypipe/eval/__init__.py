"""Stage 4: acceptance of the exported drafter measured by vLLM itself."""
