package rpc

import (
	"fmt"
	"math"
	"sync"
)

// FaultMode is what a code fault does to an operation.
type FaultMode string

// The code faults of POST /_admin/fault.
const (
	FaultNone   FaultMode = "none"   // behave normally
	FaultReturn FaultMode = "return" // answer at once with an empty, successful response
	FaultError  FaultMode = "error"  // fail: HTTP 500 and an error status on the server span
)

// ParseFaultMode checks a mode named in an admin request.
func ParseFaultMode(s string) (FaultMode, error) {
	switch m := FaultMode(s); m {
	case FaultNone, FaultReturn, FaultError:
		return m, nil
	}
	return "", fmt.Errorf("mode must be one of none, return, error; got %q", s)
}

// ParseFaultShare checks the share of requests a fault hits: in (0, 1].
func ParseFaultShare(share float64) error {
	if math.IsNaN(share) || share <= 0 || share > 1 {
		return fmt.Errorf("share must lie in (0, 1]; got %v", share)
	}
	return nil
}

// Fault is one operation's code fault: its mode, the share of the operation's requests it
// hits, and how many requests it has seen since it was set.
type Fault struct {
	Mode  FaultMode `json:"mode"`
	Share float64   `json:"share"`
	Seen  uint64    `json:"seen"`
	Hit   uint64    `json:"hit"`
}

// hits says whether the fault's next request is hit. The n-th request (from 0) is hit when
// floor((n+1) x share) passes floor(n x share): a counter, not a random draw, so that any run
// of k requests holds k x share hits, give or take one, and a test can count them.
func (f *Fault) hits() bool {
	n := float64(f.Seen)
	f.Seen++
	if math.Floor((n+1)*f.Share) > math.Floor(n*f.Share) {
		f.Hit++
		return true
	}
	return false
}

// Faults is the switchboard of code faults of one process, keyed by operation: an HTTP route
// ("/read_posts") or a server span name ("read_posts_server").
type Faults struct {
	mu     sync.Mutex
	active map[string]*Fault
}

// Set turns a fault on for an operation, hitting share (0-1] of its requests; FaultNone
// turns it off. Setting a fault again restarts its count.
func (f *Faults) Set(operation string, mode FaultMode, share float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if mode == FaultNone {
		delete(f.active, operation)
		return
	}
	if f.active == nil {
		f.active = map[string]*Fault{}
	}
	f.active[operation] = &Fault{Mode: mode, Share: share}
}

// Mode returns what to do with one request: the fault of the first of names that has one
// if this request is among the share it hits (the request is counted), else FaultNone.
func (f *Faults) Mode(names ...string) FaultMode {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range names {
		if fault, ok := f.active[n]; ok {
			if fault.hits() {
				return fault.Mode
			}
			return FaultNone
		}
	}
	return FaultNone
}

// Active returns a copy of the faults that are on.
func (f *Faults) Active() map[string]Fault {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string]Fault, len(f.active))
	for k, v := range f.active {
		out[k] = *v
	}
	return out
}
