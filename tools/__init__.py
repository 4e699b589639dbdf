"""Developer tools for the repository (not part of the installed package)."""
