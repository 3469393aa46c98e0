variable "project_id" {
  description = "Google Cloud project for the cluster."
  type        = string
}

variable "region" {
  description = "Region of the (regional) control plane and the network."
  type        = string
  default     = "us-west4"
}

variable "zone" {
  description = "Zone of every node pool. Must offer the TPU machine type (v5e ct5lp-*: e.g. us-west4-a, us-east5-b, europe-west4-b; v6e ct6e-*: e.g. us-east5-b, europe-west4-a)."
  type        = string
  default     = "us-west4-a"
}

variable "cluster_name" {
  description = "GKE cluster name."
  type        = string
  default     = "scorefn"
}

variable "release_channel" {
  description = "GKE release channel (RAPID, REGULAR, STABLE). TPU node pools need a recent GKE version; REGULAR has it."
  type        = string
  default     = "REGULAR"
}

variable "master_authorized_cidrs" {
  description = "CIDR blocks allowed to reach the public control-plane endpoint (your workstation or CI egress, e.g. [\"203.0.113.7/32\"]). Empty: only from inside the VPC."
  type        = list(string)
  default     = []
}

variable "subnet_cidr" {
  description = "Primary range of the cluster subnet (nodes)."
  type        = string
  default     = "10.20.0.0/20"
}

variable "pods_cidr" {
  description = "Secondary range for Pod IPs."
  type        = string
  default     = "10.24.0.0/14"
}

variable "services_cidr" {
  description = "Secondary range for Service IPs."
  type        = string
  default     = "10.28.0.0/20"
}

variable "master_cidr" {
  description = "/28 range for the private control-plane endpoint."
  type        = string
  default     = "172.16.0.32/28"
}

variable "system_machine_type" {
  description = "Machine type of the small CPU pool for system pods, the metrics adapter and the `cpu` overlay."
  type        = string
  default     = "e2-standard-4"
}

variable "system_max_nodes" {
  description = "Upper bound of the CPU pool."
  type        = number
  default     = 3
}

variable "tpu_machine_type" {
  description = "Single-host TPU slice machine type: v5e ct5lp-hightpu-{1,4,8}t or v6e ct6e-standard-{1,4,8}t. The trailing number is the chips per node (= google.com/tpu per pod)."
  type        = string
  default     = "ct5lp-hightpu-4t"

  validation {
    condition     = can(regex("^(ct5lp-hightpu|ct6e-standard)-(1|4|8)t$", var.tpu_machine_type))
    error_message = "tpu_machine_type must be a single-host v5e/v6e type: ct5lp-hightpu-{1,4,8}t or ct6e-standard-{1,4,8}t."
  }
}

variable "tpu_topology" {
  description = "TPU slice topology of one node (1x1, 2x2 or 2x4). scorefn runs one process per pod on one host, so the topology must hold exactly the node's chips; the k8s tpu overlay must use the same value (node selector and SCOREFN_MESH)."
  type        = string
  default     = "2x2"

  validation {
    condition     = contains(["1x1", "2x2", "2x4"], var.tpu_topology)
    error_message = "tpu_topology must be a single-host topology: 1x1, 2x2 or 2x4."
  }
}

variable "tpu_min_nodes" {
  description = "Minimum TPU nodes. 0 lets the pool scale to zero when no scorefn pod requests TPUs (e.g. replicas scaled to 0 off-hours)."
  type        = number
  default     = 0
}

variable "tpu_max_nodes" {
  description = "Maximum TPU nodes (one scorefn pod per node). Must be >= the HPA maxReplicas of the tpu overlay to let it scale fully."
  type        = number
  default     = 4
}

variable "tpu_spot" {
  description = "Use Spot TPU VMs (cheaper, can be preempted; the PodDisruptionBudget does not protect against preemption)."
  type        = bool
  default     = false
}

variable "namespace" {
  description = "Kubernetes namespace of scorefn (must match infra/k8s)."
  type        = string
  default     = "scorefn"
}

variable "kubernetes_service_account" {
  description = "Kubernetes ServiceAccount of the scorefn pods (must match infra/k8s)."
  type        = string
  default     = "scorefn"
}

variable "weights_bucket" {
  description = "Optional GCS bucket with model weights; the scorefn Kubernetes ServiceAccount gets read-only access through Workload Identity (mount it with the GCS FUSE CSI driver, enabled on the cluster)."
  type        = string
  default     = ""
}

variable "repository_id" {
  description = "Artifact Registry Docker repository holding the scorefn images (nodes get read access to it)."
  type        = string
  default     = "scorefn"
}

variable "create_repository" {
  description = "Create the Artifact Registry repository in var.region. false: it already exists (e.g. created by infra/cloudrun in the same region)."
  type        = bool
  default     = true
}

variable "deletion_protection" {
  description = "Refuse `terraform destroy` of the cluster until this is set to false."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Labels added to the cluster and nodes."
  type        = map(string)
  default     = {}
}

variable "kms_key_name" {
  description = "Optional Cloud KMS key (projects/…/cryptoKeys/…) to encrypt the Artifact Registry repository. null: Google-managed encryption."
  type        = string
  default     = null
}
