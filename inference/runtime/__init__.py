"""The runtime core: the target model, its steps and graphs, verification, and the speculative loops."""
