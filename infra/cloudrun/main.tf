# scorefn on Cloud Run with one NVIDIA L4 per instance.
#
# Scaling: Cloud Run adds instances when the running ones approach max_instance_request_concurrency
# in-flight requests (and on CPU); each instance batches its concurrent requests onto the GPU. The
# concurrency is what an instance can answer within its wait budget (Little's law: measured
# requests per second x SCOREFN_MAX_WAIT_S), so Cloud Run scales out before instances refuse (429).
# Startup: the startup probe holds traffic until GET /ready is 200 (every shape bucket compiled or
# loaded from the persistent compile cache); liveness watches GET /health. A start that fails exits
# the container (cause logged at CRITICAL), so Cloud Run fails the instance instead of billing it.

locals {
  container_port = 8080
  image          = var.image != "" ? var.image : "${var.region}-docker.pkg.dev/${var.project_id}/${var.repository_id}/scorefn:${var.image_tag}"

  weights_mount   = "/models"
  xla_cache_mount = "/var/cache/scorefn-xla"
  use_weights     = var.weights_bucket != ""
  use_xla_cache   = var.compile_cache_bucket != ""
  use_api_keys    = var.api_keys_secret_id != ""
  scorefn_model   = var.weights_path != "" ? "${local.weights_mount}/${var.weights_path}" : local.weights_mount
  service_account = "${var.service_name}-run"
  labels          = merge({ app = "scorefn", component = var.service_name }, var.labels)
  required_apis = concat(["run.googleapis.com", "artifactregistry.googleapis.com", "iam.googleapis.com"],
  local.use_collector ? ["secretmanager.googleapis.com", "cloudtrace.googleapis.com"] : [])

  # The telemetry sidecar: scorefn's traces go to it over OTLP/HTTP, and it scrapes /metrics.
  use_collector         = var.telemetry_collector
  collector_config_path = "/etc/otelcol-google"
  collector_health_port = 13133
  otlp_endpoint         = "http://localhost:4318"

  # Requests in an instance = throughput x time spent in it (Little's law). It answers requests_per_second when
  # saturated and admits a request only if it would wait at most max_wait_s: more in flight than their product
  # would only be refused. E.g. 200 requests/s x 2 s = 400.
  max_instance_request_concurrency = coalesce(var.max_instance_request_concurrency,
  min(1000, max(1, ceil(var.requests_per_second * var.max_wait_s))))

  runtime_project_roles = concat([
    # Container stdout/stderr and request logs, the built-in Cloud Run metrics and (with the telemetry sidecar)
    # Managed Prometheus samples; with the sidecar, spans to Cloud Trace.
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
  ], local.use_collector ? ["roles/cloudtrace.agent"] : [])

  # What scorefn needs to trace to the sidecar (runtime.tracing reads the standard OTEL_* variables).
  tracing_env_vars = {
    OTEL_EXPORTER_OTLP_ENDPOINT = local.otlp_endpoint
    OTEL_TRACES_SAMPLER         = "parentbased_traceidratio"
    OTEL_TRACES_SAMPLER_ARG     = tostring(var.trace_sampling_ratio)
    OTEL_SERVICE_NAME           = var.service_name
    GOOGLE_CLOUD_PROJECT        = var.project_id # log lines link to their traces in this project's Cloud Trace
  }
  tracing_env = local.use_collector ? local.tracing_env_vars : {}
  # otel-collector.yaml's placeholders
  collector_config_vars = {
    port            = local.container_port
    scrape_interval = var.metrics_scrape_interval
    health_port     = local.collector_health_port
  }
}

resource "google_project_service" "required" {
  for_each           = toset(local.required_apis)
  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}

resource "google_artifact_registry_repository" "scorefn" {
  project       = var.project_id
  location      = var.region
  repository_id = var.repository_id
  description   = "scorefn container images (cpu, cuda12, tpu)"
  format        = "DOCKER"
  kms_key_name  = var.kms_key_name
  labels        = local.labels

  depends_on = [google_project_service.required]
}

# ------------------------------------------------------------------ identity (least privilege)

resource "google_service_account" "scorefn" {
  project      = var.project_id
  account_id   = local.service_account
  display_name = "scorefn Cloud Run runtime"
  description  = "Runtime identity of the ${var.service_name} Cloud Run service: reads its image and (optionally) its weights bucket, writes logs and metrics."
}

resource "google_project_iam_member" "runtime" {
  for_each = toset(local.runtime_project_roles)
  project  = var.project_id
  role     = each.value
  member   = "serviceAccount:${google_service_account.scorefn.email}"
}

# Scoped to this one repository, not the project.
resource "google_artifact_registry_repository_iam_member" "image_reader" {
  project    = var.project_id
  location   = google_artifact_registry_repository.scorefn.location
  repository = google_artifact_registry_repository.scorefn.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.scorefn.email}"
}

# Read-only on the weights bucket only.
resource "google_storage_bucket_iam_member" "weights_reader" {
  count  = local.use_weights ? 1 : 0
  bucket = var.weights_bucket
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.scorefn.email}"
}

# Read/write objects (no bucket admin) on the shared compile-cache bucket only.
resource "google_storage_bucket_iam_member" "xla_cache_user" {
  count  = local.use_xla_cache ? 1 : 0
  bucket = var.compile_cache_bucket
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.scorefn.email}"
}

# The telemetry sidecar's configuration, mounted into it as a file.
resource "google_secret_manager_secret" "collector_config" {
  count     = local.use_collector ? 1 : 0
  project   = var.project_id
  secret_id = "${var.service_name}-otel-collector"
  labels    = local.labels

  replication {
    auto {}
  }

  depends_on = [google_project_service.required]
}

resource "google_secret_manager_secret_version" "collector_config" {
  count       = local.use_collector ? 1 : 0
  secret      = google_secret_manager_secret.collector_config[0].id
  secret_data = templatefile("${path.module}/otel-collector.yaml", local.collector_config_vars)
}

resource "google_secret_manager_secret_iam_member" "collector_config_accessor" {
  count     = local.use_collector ? 1 : 0
  project   = var.project_id
  secret_id = google_secret_manager_secret.collector_config[0].secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.scorefn.email}"
}

resource "google_secret_manager_secret_iam_member" "api_keys_accessor" {
  count     = local.use_api_keys ? 1 : 0
  project   = var.project_id
  secret_id = var.api_keys_secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.scorefn.email}"
}

# ------------------------------------------------------------------ service

resource "google_cloud_run_v2_service" "scorefn" {
  project             = var.project_id
  name                = var.service_name
  location            = var.region
  ingress             = var.ingress
  deletion_protection = var.deletion_protection
  labels              = local.labels

  template {
    service_account                  = google_service_account.scorefn.email
    execution_environment            = "EXECUTION_ENVIRONMENT_GEN2"
    max_instance_request_concurrency = local.max_instance_request_concurrency
    timeout                          = "${var.request_timeout_s}s"
    gpu_zonal_redundancy_disabled    = var.gpu_zonal_redundancy_disabled
    session_affinity                 = var.session_affinity
    labels                           = local.labels

    scaling {
      min_instance_count = var.min_instances
      max_instance_count = var.max_instances
    }

    node_selector {
      accelerator = "nvidia-l4"
    }

    containers {
      name  = "scorefn"
      image = local.image

      # Cloud Run sets PORT to this value; `scorefn serve` binds it.
      ports {
        name           = "http1"
        container_port = local.container_port
      }

      resources {
        limits = {
          cpu              = var.cpu
          memory           = var.memory
          "nvidia.com/gpu" = "1"
        }
        # GPU services use instance-based billing: CPU stays allocated outside requests, which also
        # keeps the batcher thread running between requests.
        cpu_idle          = false
        startup_cpu_boost = true
      }

      # Cloud Run sends SIGTERM and kills the instance 10 s later: drain within that.
      env {
        name  = "SCOREFN_DRAIN_GRACE_S"
        value = "8"
      }

      env {
        name  = "SCOREFN_MAX_WAIT_S"
        value = tostring(var.max_wait_s)
      }

      dynamic "env" {
        for_each = local.use_weights ? [local.scorefn_model] : []
        content {
          name  = "SCOREFN_MODEL"
          value = env.value
        }
      }

      dynamic "env" {
        for_each = local.use_xla_cache ? [local.xla_cache_mount] : []
        content {
          name  = "SCOREFN_COMPILE_CACHE_DIR"
          value = env.value
        }
      }

      dynamic "env" {
        for_each = local.use_api_keys ? [var.api_keys_secret_id] : []
        content {
          name = "SCOREFN_API_KEYS"
          value_source {
            secret_key_ref {
              secret  = env.value
              version = "latest"
            }
          }
        }
      }

      dynamic "env" {
        for_each = local.tracing_env
        content {
          name  = env.key
          value = env.value
        }
      }

      dynamic "env" {
        for_each = var.scorefn_env
        content {
          name  = env.key
          value = env.value
        }
      }

      # /ready is 200 only after every shape bucket is compiled (or loaded from the cache), so no
      # request is routed to an instance that would compile on the request path.
      startup_probe {
        initial_delay_seconds = 0
        period_seconds        = 10
        timeout_seconds       = 5
        failure_threshold     = var.startup_probe_failure_threshold
        http_get {
          path = "/ready"
          port = local.container_port
        }
      }

      # /health only says the process runs; a failing liveness probe restarts the container.
      liveness_probe {
        initial_delay_seconds = 0
        period_seconds        = 30
        timeout_seconds       = 5
        failure_threshold     = 3
        http_get {
          path = "/health"
          port = local.container_port
        }
      }

      dynamic "volume_mounts" {
        for_each = local.use_weights ? ["weights"] : []
        content {
          name       = volume_mounts.value
          mount_path = local.weights_mount
        }
      }

      dynamic "volume_mounts" {
        for_each = local.use_xla_cache ? ["xla-cache"] : []
        content {
          name       = volume_mounts.value
          mount_path = local.xla_cache_mount
        }
      }
    }

    # The telemetry sidecar: receives scorefn's spans on localhost:4318 and scrapes localhost:8080/metrics.
    dynamic "containers" {
      for_each = local.use_collector ? ["otel-collector"] : []
      content {
        name  = containers.value
        image = var.collector_image
        args  = ["--config=${local.collector_config_path}/config.yaml"]

        resources {
          limits = {
            cpu    = "1"
            memory = "512Mi"
          }
          cpu_idle = false
        }

        startup_probe {
          period_seconds    = 5
          timeout_seconds   = 2
          failure_threshold = 12
          http_get {
            path = "/"
            port = local.collector_health_port
          }
        }

        volume_mounts {
          name       = "otel-collector-config"
          mount_path = local.collector_config_path
        }
      }
    }

    dynamic "volumes" {
      for_each = local.use_collector ? ["otel-collector-config"] : []
      content {
        name = volumes.value
        secret {
          secret = google_secret_manager_secret.collector_config[0].secret_id
          items {
            version = google_secret_manager_secret_version.collector_config[0].version
            path    = "config.yaml"
          }
        }
      }
    }

    dynamic "volumes" {
      for_each = local.use_weights ? ["weights"] : []
      content {
        name = volumes.value
        gcs {
          bucket    = var.weights_bucket
          read_only = true
        }
      }
    }

    dynamic "volumes" {
      for_each = local.use_xla_cache ? ["xla-cache"] : []
      content {
        name = volumes.value
        gcs {
          bucket    = var.compile_cache_bucket
          read_only = false
        }
      }
    }
  }

  traffic {
    type    = "TRAFFIC_TARGET_ALLOCATION_TYPE_LATEST"
    percent = 100
  }

  depends_on = [
    google_project_service.required,
    google_project_iam_member.runtime,
    google_artifact_registry_repository_iam_member.image_reader,
    google_storage_bucket_iam_member.weights_reader,
    google_storage_bucket_iam_member.xla_cache_user,
    google_secret_manager_secret_iam_member.api_keys_accessor,
    google_secret_manager_secret_iam_member.collector_config_accessor,
  ]
}

resource "google_cloud_run_v2_service_iam_member" "invoker" {
  for_each = toset(var.invoker_members)
  project  = var.project_id
  location = google_cloud_run_v2_service.scorefn.location
  name     = google_cloud_run_v2_service.scorefn.name
  role     = "roles/run.invoker"
  member   = each.value
}
