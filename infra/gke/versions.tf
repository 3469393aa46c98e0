terraform {
  required_version = ">= 1.6.0, < 2.0.0"

  required_providers {
    google = {
      source = "hashicorp/google"
      # 6.x+: TPU node pools, Workload Identity, Managed Prometheus and GCS FUSE addon fields.
      version = ">= 6.38.0, < 8.0.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}
