terraform {
  required_version = ">= 1.6.0, < 2.0.0"

  required_providers {
    google = {
      source = "hashicorp/google"
      # 6.38+ has template.gpu_zonal_redundancy_disabled and GA GPU fields on google_cloud_run_v2_service.
      version = ">= 6.38.0, < 8.0.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}
