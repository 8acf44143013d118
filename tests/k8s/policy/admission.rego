# The admission rules platform teams commonly enforce (the usual Kyverno and Gatekeeper library
# policies and Pod Security "restricted"), written here in Rego for OPA, which the Kubernetes
# tier builds from its module. The admission scenario evaluates `deny` over the packaged chart's
# default render (`input.render`, helm template's text): it must be empty. Each message names
# the object, the container and the rule.
package ublkd.admission

objects := [o |
	some doc in split(input.render, "\n---\n")
	o := yaml.unmarshal(doc)
	is_object(o)
]

workloads := [w |
	some w in objects
	w.kind in {"Deployment", "DaemonSet", "StatefulSet", "Job"}
]

# The workloads without host access: these run under Pod Security "restricted".
restricted := [w | some w in workloads; w.kind in {"Deployment", "Job"}]

pod(w) := w.spec.template.spec

containers(w) := array.concat(object.get(pod(w), "initContainers", []), pod(w).containers)

what(w, c) := sprintf("%s %s, container %s", [w.kind, w.metadata.name, c.name])

# A securityContext setting of the container, else of its pod.
setting(w, c, key) := v if {
	v := c.securityContext[key]
} else := v if {
	v := pod(w).securityContext[key]
}

# require-requests-limits
deny contains msg if {
	some w in workloads
	some c in containers(w)
	some path in [["requests", "cpu"], ["requests", "memory"], ["limits", "memory"]]
	object.get(c, array.concat(["resources"], path), null) == null
	msg := sprintf("%s: no resources.%s", [what(w, c), concat(".", path)])
}

# require-security-context
deny contains msg if {
	some w in workloads
	some c in containers(w)
	not c.securityContext
	msg := sprintf("%s: no securityContext", [what(w, c)])
}

# disallow-latest-tag: an image names a tag or a digest, never latest
deny contains msg if {
	some w in workloads
	some c in containers(w)
	last := regex.replace(c.image, "^.*/", "")
	not contains(last, "@")
	not regex.match(`:[^:]+$`, last)
	msg := sprintf("%s: image %s has no tag or digest", [what(w, c), c.image])
}

deny contains msg if {
	some w in workloads
	some c in containers(w)
	endswith(c.image, ":latest")
	msg := sprintf("%s: image %s is :latest", [what(w, c), c.image])
}

# require-labels: the recommended labels on every workload's pods
deny contains msg if {
	some w in workloads
	some label in ["app.kubernetes.io/name", "app.kubernetes.io/instance"]
	not w.spec.template.metadata.labels[label]
	msg := sprintf("%s %s: pods lack the label %s", [w.kind, w.metadata.name, label])
}

# Pod Security "restricted", for the workloads without host access
non_root(w, c) if setting(w, c, "runAsNonRoot") == true

deny contains msg if {
	some w in restricted
	some c in containers(w)
	not non_root(w, c)
	msg := sprintf("%s: runAsNonRoot is not true", [what(w, c)])
}

deny contains msg if {
	some w in restricted
	some c in containers(w)
	not c.securityContext.allowPrivilegeEscalation == false
	msg := sprintf("%s: allowPrivilegeEscalation is not false", [what(w, c)])
}

deny contains msg if {
	some w in restricted
	some c in containers(w)
	not "ALL" in object.get(c, ["securityContext", "capabilities", "drop"], [])
	msg := sprintf("%s: capabilities do not drop ALL", [what(w, c)])
}

seccomp_ok(w, c) if {
	p := setting(w, c, "seccompProfile")
	p.type in {"RuntimeDefault", "Localhost"}
}

deny contains msg if {
	some w in restricted
	some c in containers(w)
	not seccomp_ok(w, c)
	msg := sprintf("%s: no RuntimeDefault or Localhost seccompProfile", [what(w, c)])
}

deny contains msg if {
	some w in restricted
	some c in containers(w)
	c.securityContext.privileged == true
	msg := sprintf("%s: privileged", [what(w, c)])
}

deny contains msg if {
	some w in restricted
	some key in ["hostNetwork", "hostPID", "hostIPC"]
	pod(w)[key] == true
	msg := sprintf("%s %s: %s", [w.kind, w.metadata.name, key])
}

deny contains msg if {
	some w in restricted
	some v in object.get(pod(w), "volumes", [])
	v.hostPath
	msg := sprintf("%s %s: hostPath volume %s", [w.kind, w.metadata.name, v.name])
}

deny contains msg if {
	some w in restricted
	some c in containers(w)
	some p in object.get(c, "ports", [])
	p.hostPort
	msg := sprintf("%s: hostPort %d", [what(w, c), p.hostPort])
}
