# GKE Standard cluster for scorefn on TPU: a small CPU pool for system pods and a single-host TPU
# slice pool (v5e/v6e) that autoscales from zero. Workload Identity, Managed Prometheus (scrapes
# scorefn's /metrics through the PodMonitoring in infra/k8s) and private nodes.

locals {
  labels = merge({ app = "scorefn" }, var.labels)

  # "ct5lp-hightpu-4t" -> 4 chips per node; "2x2" -> 4 chips in the slice.
  tpu_chips_per_node = tonumber(regex("-([0-9]+)t$", var.tpu_machine_type)[0])
  tpu_topology_dims  = [for d in split("x", var.tpu_topology) : tonumber(d)]
  tpu_topology_chips = local.tpu_topology_dims[0] * local.tpu_topology_dims[1]
  # Value of the node label cloud.google.com/gke-tpu-accelerator (the k8s tpu overlay selects on it).
  tpu_accelerator = startswith(var.tpu_machine_type, "ct5lp-") ? "tpu-v5-lite-podslice" : "tpu-v6e-slice"

  workload_pool = "${var.project_id}.svc.id.goog"
  # Workload Identity Federation principals: IAM grants go to Kubernetes ServiceAccounts directly.
  wi_principal_prefix = "principal://iam.googleapis.com/projects/${data.google_project.this.number}/locations/global/workloadIdentityPools/${local.workload_pool}/subject"
  scorefn_principal   = "${local.wi_principal_prefix}/ns/${var.namespace}/sa/${var.kubernetes_service_account}"
  # The Custom Metrics Stackdriver Adapter serves prometheus.googleapis.com|scorefn_engine_load|gauge to the HPA.
  metrics_adapter_principal = "${local.wi_principal_prefix}/ns/custom-metrics/sa/custom-metrics-stackdriver-adapter"

  node_scopes = ["https://www.googleapis.com/auth/cloud-platform"]
}

data "google_project" "this" {
  project_id = var.project_id
}

resource "google_project_service" "required" {
  for_each           = toset(["container.googleapis.com", "compute.googleapis.com", "artifactregistry.googleapis.com", "monitoring.googleapis.com", "binaryauthorization.googleapis.com"])
  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}

# ------------------------------------------------------------------ network

resource "google_compute_network" "scorefn" {
  project                 = var.project_id
  name                    = var.cluster_name
  auto_create_subnetworks = false
  depends_on              = [google_project_service.required]
}

resource "google_compute_subnetwork" "nodes" {
  project       = var.project_id
  name          = "${var.cluster_name}-nodes"
  region        = var.region
  network       = google_compute_network.scorefn.id
  ip_cidr_range = var.subnet_cidr
  # Private nodes pull images from Artifact Registry through Private Google Access (no NAT needed).
  private_ip_google_access = true

  secondary_ip_range {
    range_name    = "pods"
    ip_cidr_range = var.pods_cidr
  }
  secondary_ip_range {
    range_name    = "services"
    ip_cidr_range = var.services_cidr
  }

  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# ------------------------------------------------------------------ identities

resource "google_service_account" "nodes" {
  project      = var.project_id
  account_id   = "${var.cluster_name}-nodes"
  display_name = "scorefn GKE nodes"
  description  = "Node identity: logs, metrics, image pulls. Workloads use Workload Identity instead."
}

resource "google_project_iam_member" "nodes" {
  for_each = toset(["roles/container.defaultNodeServiceAccount"])
  project  = var.project_id
  role     = each.value
  member   = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_artifact_registry_repository" "scorefn" {
  count         = var.create_repository ? 1 : 0
  project       = var.project_id
  location      = var.region
  repository_id = var.repository_id
  description   = "scorefn container images (cpu, cuda12, tpu)"
  format        = "DOCKER"
  kms_key_name  = var.kms_key_name
  labels        = local.labels
  depends_on    = [google_project_service.required]
}

resource "google_artifact_registry_repository_iam_member" "nodes_reader" {
  project    = var.project_id
  location   = var.region
  repository = var.create_repository ? google_artifact_registry_repository.scorefn[0].name : var.repository_id
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.nodes.email}"
}

# scorefn pods read the weights bucket (if any) and nothing else.
resource "google_storage_bucket_iam_member" "scorefn_weights_reader" {
  count  = var.weights_bucket != "" ? 1 : 0
  bucket = var.weights_bucket
  role   = "roles/storage.objectViewer"
  member = local.scorefn_principal
}

# The metrics adapter only reads Cloud Monitoring.
resource "google_project_iam_member" "metrics_adapter_viewer" {
  project = var.project_id
  role    = "roles/monitoring.viewer"
  member  = local.metrics_adapter_principal
}

# ------------------------------------------------------------------ cluster

resource "google_container_cluster" "scorefn" {
  project        = var.project_id
  name           = var.cluster_name
  location       = var.region
  node_locations = [var.zone]

  network         = google_compute_network.scorefn.id
  subnetwork      = google_compute_subnetwork.nodes.id
  networking_mode = "VPC_NATIVE"
  ip_allocation_policy {
    cluster_secondary_range_name  = "pods"
    services_secondary_range_name = "services"
  }

  # Node pools are managed below; the default pool is removed right after creation.
  remove_default_node_pool = true
  initial_node_count       = 1

  deletion_protection = var.deletion_protection
  resource_labels     = local.labels

  release_channel {
    channel = var.release_channel
  }

  workload_identity_config {
    workload_pool = local.workload_pool
  }

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false
    master_ipv4_cidr_block  = var.master_cidr
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.master_authorized_cidrs
      content {
        cidr_block   = cidr_blocks.value
        display_name = "authorized-${cidr_blocks.key}"
      }
    }
  }

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  # Dataplane V2 enforces NetworkPolicy.
  datapath_provider           = "ADVANCED_DATAPATH"
  enable_intranode_visibility = true
  enable_shielded_nodes       = true
  enable_legacy_abac          = false

  binary_authorization {
    evaluation_mode = "PROJECT_SINGLETON_POLICY_ENFORCE"
  }

  addons_config {
    horizontal_pod_autoscaling {
      disabled = false
    }
    http_load_balancing {
      disabled = false
    }
    gcs_fuse_csi_driver_config {
      enabled = true
    }
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }

  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
    managed_prometheus {
      enabled = true
    }
  }

  depends_on = [google_project_service.required]
}

resource "google_container_node_pool" "system" {
  project  = var.project_id
  name     = "system"
  cluster  = google_container_cluster.scorefn.id
  location = var.region

  autoscaling {
    total_min_node_count = 1
    total_max_node_count = var.system_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.system_machine_type
    image_type      = "COS_CONTAINERD"
    service_account = google_service_account.nodes.email
    oauth_scopes    = local.node_scopes
    labels          = local.labels
    metadata        = { disable-legacy-endpoints = "true" }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }
}

# Single-host TPU slice nodes: each node is one VM with tpu_topology chips; one scorefn pod takes
# all of them (google.com/tpu = chips per node). GKE taints TPU nodes with google.com/tpu, so only
# pods that request TPUs land here. No placement_policy: that is for multi-host slices.
resource "google_container_node_pool" "tpu" {
  project  = var.project_id
  name     = "tpu-${replace(var.tpu_topology, "x", "-")}"
  cluster  = google_container_cluster.scorefn.id
  location = var.region

  autoscaling {
    total_min_node_count = var.tpu_min_nodes
    total_max_node_count = var.tpu_max_nodes
    location_policy      = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.tpu_machine_type
    image_type      = "COS_CONTAINERD"
    spot            = var.tpu_spot
    service_account = google_service_account.nodes.email
    oauth_scopes    = local.node_scopes
    labels          = local.labels
    metadata        = { disable-legacy-endpoints = "true" }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }

  lifecycle {
    precondition {
      condition     = local.tpu_topology_chips == local.tpu_chips_per_node
      error_message = "tpu_topology must hold exactly the chips of one ${var.tpu_machine_type} node (${local.tpu_chips_per_node}): scorefn serves from a single host."
    }
  }
}
