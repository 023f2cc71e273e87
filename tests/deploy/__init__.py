"""Static and live checks of the deployment files (Dockerfile, compose, Kubernetes)."""
