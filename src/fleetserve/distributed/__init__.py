"""Process groups and collectives for TP, DP attention and EP."""
