output "url" {
  description = "HTTPS URL of the scorefn service (POST <url>/v1/score)."
  value       = google_cloud_run_v2_service.scorefn.uri
}

output "image" {
  description = "Image reference the service runs."
  value       = local.image
}

output "repository" {
  description = "Artifact Registry path to push images to (docker/podman push <repository>/scorefn:<tag>)."
  value       = "${google_artifact_registry_repository.scorefn.location}-docker.pkg.dev/${var.project_id}/${google_artifact_registry_repository.scorefn.repository_id}"
}

output "service_account" {
  description = "Email of the runtime service account."
  value       = google_service_account.scorefn.email
}

output "max_instance_request_concurrency" {
  description = "Concurrent requests per instance: max_instance_request_concurrency, or ceil(requests_per_second x max_wait_s)."
  value       = local.max_instance_request_concurrency
}

output "batch_job" {
  description = "Name of the Cloud Run Job running `scorefn batch` (gcloud run jobs execute <name>), or null without batch_bucket."
  value       = local.use_batch ? google_cloud_run_v2_job.batch[0].name : null
}
