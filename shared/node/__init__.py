"""Node plumbing both node kinds share: settings defined once (`settings.py`, `node_settings.py`), secrets,
link credentials and TLS, the HTTP server, metrics, tenants, tracing, environment variables, the CLI's common
parts. Nothing here runs a model."""
