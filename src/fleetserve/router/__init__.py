"""Cache-aware HTTP load balancer. Never imports torch."""
