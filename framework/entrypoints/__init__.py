"""kvforge package."""
