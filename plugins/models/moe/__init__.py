"""Shared mixture-of-experts layer of the MoE model plugins (Mixtral, Qwen2-MoE)."""
