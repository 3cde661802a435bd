"""What every mesh service shares: NATS subjects, the embedded NATS server, the service
lifecycle (config line at start, /health and /metrics, clean SIGTERM)."""
