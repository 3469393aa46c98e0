"""Offline checks of the Containerfile, the Terraform (Cloud Run, GKE) and the Kubernetes manifests."""
