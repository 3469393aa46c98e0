output "cluster_name" {
  description = "GKE cluster name (gcloud container clusters get-credentials <name> --region <region>)."
  value       = google_container_cluster.scorefn.name
}

output "region" {
  description = "Cluster region."
  value       = var.region
}

output "tpu_accelerator" {
  description = "Value of the node label cloud.google.com/gke-tpu-accelerator; the k8s tpu overlay must select on it."
  value       = local.tpu_accelerator
}

output "tpu_topology" {
  description = "Value of the node label cloud.google.com/gke-tpu-topology; the k8s tpu overlay must select on it."
  value       = var.tpu_topology
}

output "tpu_chips_per_node" {
  description = "google.com/tpu per scorefn pod, and the product of SCOREFN_MESH (DATAxMODEL)."
  value       = local.tpu_chips_per_node
}

output "repository" {
  description = "Artifact Registry path to push images to."
  value       = "${var.region}-docker.pkg.dev/${var.project_id}/${var.repository_id}"
}
