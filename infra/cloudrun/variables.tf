variable "project_id" {
  description = "Google Cloud project that hosts the service, its image repository and its service account."
  type        = string
}

variable "region" {
  description = "Cloud Run region. Must offer NVIDIA L4 GPUs on Cloud Run (e.g. us-central1, europe-west1, europe-west4, asia-southeast1)."
  type        = string
  default     = "us-central1"
}

variable "service_name" {
  description = "Name of the Cloud Run service (also used for the service account id and labels)."
  type        = string
  default     = "scorefn"
}

variable "repository_id" {
  description = "Artifact Registry Docker repository created for the scorefn images."
  type        = string
  default     = "scorefn"
}

variable "image" {
  description = "Full image reference to deploy. Empty: <region>-docker.pkg.dev/<project>/<repository_id>/scorefn:<image_tag>. Prefer a digest (…@sha256:…) in production."
  type        = string
  default     = ""
}

variable "image_tag" {
  description = "Tag of the scorefn image in the repository when `image` is empty. Build it with --build-arg ACCELERATOR=cuda12."
  type        = string
  default     = "cuda12"
}

variable "cpu" {
  description = "vCPUs per instance. Cloud Run GPU instances need at least 4 (8 recommended): tokenization and JSON run on the CPU."
  type        = string
  default     = "4"

  validation {
    condition     = tonumber(var.cpu) >= 4
    error_message = "Cloud Run requires at least 4 vCPUs for an instance with a GPU."
  }
}

variable "memory" {
  description = "Memory per instance, in Gi (e.g. 16Gi). Cloud Run GPU instances need at least 16Gi (32Gi recommended)."
  type        = string
  default     = "16Gi"

  validation {
    condition     = can(regex("^[0-9]+Gi$", var.memory)) && tonumber(trimsuffix(var.memory, "Gi")) >= 16
    error_message = "memory must look like 16Gi and be at least 16Gi for a GPU instance."
  }
}

variable "gpu_zonal_redundancy_disabled" {
  description = "true: best-effort GPU capacity across zones at a lower price (needs the 'without zonal redundancy' L4 quota). false: reserved zonal redundancy."
  type        = bool
  default     = true
}

variable "min_instances" {
  description = "Instances kept warm. 0 scales to zero (every cold start pays image pull + weight load + executable load); 1+ removes cold starts for the first requests."
  type        = number
  default     = 0
}

variable "max_instances" {
  description = "Upper bound of instances (and L4 GPUs) the service may use; keep it within the project's Cloud Run GPU quota."
  type        = number
  default     = 3
}

variable "session_affinity" {
  description = "Route a client's requests to the same instance (Cloud Run's cookie-based session affinity, best effort): each instance has its own prefix cache, so a client that repeats a prompt finds it cached on the instance that computed it."
  type        = bool
  default     = false
}

variable "max_wait_s" {
  description = "SCOREFN_MAX_WAIT_S: an instance refuses a request (429 with Retry-After) whose predicted wait for the GPU would exceed this many seconds. With requests_per_second it sets max_instance_request_concurrency."
  type        = number
  default     = 2

  validation {
    condition     = var.max_wait_s > 0
    error_message = "max_wait_s must be above 0."
  }
}

variable "requests_per_second" {
  description = "Requests per second one instance answers when saturated, for your request mix, measured: run `python -m loadtests.run --open-loop 4` against the image on an L4 (its calibrated rate). The default is a placeholder until you have measured it: no L4 has been measured for this module."
  type        = number
  default     = 200

  validation {
    condition     = var.requests_per_second > 0
    error_message = "requests_per_second must be above 0."
  }
}

variable "max_instance_request_concurrency" {
  description = "Requests one instance handles at once; Cloud Run adds instances as the running ones approach it. null: ceil(requests_per_second x max_wait_s) within 1..1000, the requests an instance can answer within the wait budget (infra/README.md has the arithmetic)."
  type        = number
  default     = null

  validation {
    condition     = var.max_instance_request_concurrency == null ? true : var.max_instance_request_concurrency >= 1 && var.max_instance_request_concurrency <= 1000
    error_message = "Cloud Run allows 1..1000 concurrent requests per instance."
  }
}

variable "request_timeout_s" {
  description = "Cloud Run request timeout in seconds (scorefn itself drops requests queued longer than SCOREFN_REQUEST_TIMEOUT_S)."
  type        = number
  default     = 60
}

variable "startup_probe_failure_threshold" {
  description = "Startup probe attempts (every 10 s) on /ready before Cloud Run gives up on an instance. /ready turns 200 after every shape bucket is compiled or loaded from the compile cache; 60 allows 10 minutes for a first start that compiles."
  type        = number
  default     = 60
}

variable "weights_bucket" {
  description = "Optional GCS bucket holding a Hugging Face model directory. Empty: serve the model baked into the image. Set: the bucket is mounted read-only at /models and SCOREFN_MODEL=/models/<weights_path>."
  type        = string
  default     = ""
}

variable "weights_path" {
  description = "Directory (or .gguf file) inside weights_bucket that holds the model, e.g. 'llama-3.2-1b'."
  type        = string
  default     = ""
}

variable "compile_cache_bucket" {
  description = "Optional GCS bucket for a shared, writable JAX compilation cache (mounted at /var/cache/scorefn-xla). Useful when the image was built without a GPU: the first instance compiles and writes, later instances load. Empty: use the cache baked into the image."
  type        = string
  default     = ""
}

variable "api_keys_secret_id" {
  description = "Optional Secret Manager secret (id in this project) whose latest version is a comma-separated list of API keys, exposed as SCOREFN_API_KEYS. Empty: no API keys (access is controlled by Cloud Run IAM)."
  type        = string
  default     = ""
}

variable "invoker_members" {
  description = "IAM members granted roles/run.invoker (e.g. serviceAccount:client@proj.iam.gserviceaccount.com). Add \"allUsers\" only together with api_keys_secret_id."
  type        = list(string)
  default     = []
}

variable "ingress" {
  description = "Cloud Run ingress: INGRESS_TRAFFIC_ALL, INGRESS_TRAFFIC_INTERNAL_ONLY or INGRESS_TRAFFIC_INTERNAL_LOAD_BALANCER."
  type        = string
  default     = "INGRESS_TRAFFIC_ALL"
}

variable "scorefn_env" {
  description = "Extra SCOREFN_* settings for the container, e.g. { SCOREFN_MAX_QUEUE = \"128\", SCOREFN_MAX_ITEMS = \"512\" }. See runtime/settings.py for the table."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for name in keys(var.scorefn_env) : startswith(name, "SCOREFN_")])
    error_message = "scorefn_env keys must start with SCOREFN_ (PORT is set by Cloud Run)."
  }
}

variable "kms_key_name" {
  description = "Optional Cloud KMS key (projects/…/cryptoKeys/…) to encrypt the Artifact Registry repository. null: Google-managed encryption."
  type        = string
  default     = null
}

variable "deletion_protection" {
  description = "Refuse `terraform destroy` of the Cloud Run service until this is set to false."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Labels added to every resource that takes labels."
  type        = map(string)
  default     = {}
}

# ------------------------------------------------------------------ batch job (job.tf)

variable "batch_bucket" {
  description = "Cloud Storage bucket holding the batch input and receiving its output, mounted at /data in the Cloud Run Job `<service_name>-batch`. Empty: no job."
  type        = string
  default     = ""
}

variable "batch_input" {
  description = "Path of the OpenAI batch-format JSONL input inside batch_bucket."
  type        = string
  default     = "batch/input.jsonl"
}

variable "batch_output" {
  description = "Path of the output inside batch_bucket; each task writes <batch_output>.shard-IIIII-of-NNNNN beside it for `scorefn batch merge`."
  type        = string
  default     = "batch/output.jsonl"
}

variable "batch_task_count" {
  description = "Tasks (shards) the input is split into: task i takes lines i, i + count, i + 2 count, ..."
  type        = number
  default     = 8

  validation {
    condition     = var.batch_task_count >= 1 && var.batch_task_count <= 10000
    error_message = "batch_task_count must be between 1 and 10000."
  }
}

variable "batch_parallelism" {
  description = "Tasks running at once, each on its own L4 (within the project's Cloud Run GPU quota)."
  type        = number
  default     = 4

  validation {
    condition     = var.batch_parallelism >= 1
    error_message = "batch_parallelism must be at least 1."
  }
}

variable "batch_task_timeout_s" {
  description = "Seconds a task may run before Cloud Run stops it (SIGTERM: its lines in flight are written; a retry goes on)."
  type        = number
  default     = 86400
}

variable "batch_max_retries" {
  description = "Retries of a failed task; each retry goes on from the task's own output file."
  type        = number
  default     = 3
}

variable "telemetry_collector" {
  description = "true: run the Google-Built OpenTelemetry Collector as a sidecar (config: otel-collector.yaml, kept in Secret Manager). scorefn exports its traces to it (Cloud Trace) and it scrapes /metrics into Managed Prometheus (infra/grafana's dashboard). false: logs and Cloud Run's built-in metrics only."
  type        = bool
  default     = false
}

variable "collector_image" {
  description = "The telemetry sidecar's image (Google-Built OpenTelemetry Collector). Prefer a digest in production."
  type        = string
  default     = "us-docker.pkg.dev/cloud-ops-agents-artifacts/google-cloud-opentelemetry-collector/otelcol-google:0.156.0"
}

variable "trace_sampling_ratio" {
  description = "With telemetry_collector: the share of requests traced when the caller sent no sampled trace (OTEL_TRACES_SAMPLER=parentbased_traceidratio); a caller's sampling decision in traceparent is followed."
  type        = number
  default     = 0.1

  validation {
    condition     = var.trace_sampling_ratio >= 0 && var.trace_sampling_ratio <= 1
    error_message = "trace_sampling_ratio is a share of requests, between 0 and 1."
  }
}

variable "metrics_scrape_interval" {
  description = "With telemetry_collector: how often the sidecar scrapes /metrics into Managed Prometheus (a Prometheus duration)."
  type        = string
  default     = "15s"
}
