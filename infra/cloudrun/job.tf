# `scorefn batch` as a Cloud Run Job, one NVIDIA L4 per task (created when batch_bucket is set).
#
# Each task runs the model in process (no HTTP) on its share of the input: Cloud Run gives it CLOUD_RUN_TASK_INDEX
# and CLOUD_RUN_TASK_COUNT, and it takes lines i with i mod count == index, writing
# <batch_output>.shard-IIIII-of-NNNNN into the bucket, mounted at /data with Cloud Storage FUSE. A task that fails
# or is stopped is retried up to batch_max_retries times and goes on from its own file (a torn last line is redone).
# Then `scorefn batch merge` joins the shards in input order (infra/README.md, "A million lines").

locals {
  use_batch   = var.batch_bucket != ""
  batch_mount = "/data"
}

# Read/write objects (no bucket admin) on the batch bucket only.
resource "google_storage_bucket_iam_member" "batch_user" {
  count  = local.use_batch ? 1 : 0
  bucket = var.batch_bucket
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.scorefn.email}"
}

resource "google_cloud_run_v2_job" "batch" {
  count               = local.use_batch ? 1 : 0
  project             = var.project_id
  name                = "${var.service_name}-batch"
  location            = var.region
  deletion_protection = var.deletion_protection
  labels              = local.labels

  template {
    task_count  = var.batch_task_count
    parallelism = var.batch_parallelism
    labels      = local.labels

    template {
      service_account = google_service_account.scorefn.email
      timeout         = "${var.batch_task_timeout_s}s"
      max_retries     = var.batch_max_retries

      node_selector {
        accelerator = "nvidia-l4"
      }

      containers {
        name    = "scorefn-batch"
        image   = local.image
        command = ["scorefn"]
        args    = ["batch", "${local.batch_mount}/${var.batch_input}", "${local.batch_mount}/${var.batch_output}", "--progress", "log"]

        resources {
          limits = {
            cpu              = var.cpu
            memory           = var.memory
            "nvidia.com/gpu" = "1"
          }
        }

        dynamic "env" {
          for_each = local.use_weights ? [local.scorefn_model] : []
          content {
            name  = "SCOREFN_MODEL"
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

        volume_mounts {
          name       = "data"
          mount_path = local.batch_mount
        }

        dynamic "volume_mounts" {
          for_each = local.use_weights ? [local.weights_mount] : []
          content {
            name       = "weights"
            mount_path = volume_mounts.value
          }
        }
      }

      volumes {
        name = "data"
        gcs {
          bucket    = var.batch_bucket
          read_only = false
        }
      }

      dynamic "volumes" {
        for_each = local.use_weights ? [var.weights_bucket] : []
        content {
          name = "weights"
          gcs {
            bucket    = volumes.value
            read_only = true
          }
        }
      }
    }
  }

  depends_on = [google_project_service.required, google_storage_bucket_iam_member.batch_user]
}
