// Package app holds the socialnet services: DeathStarBench's Social Network
// (/work/shared/reference/socialnet.md) as twelve small Go services, one per process.
//
// Each Service declares the peers and stores it needs, the tables it creates, and registers
// its operations on an rpc.Server. The call graph (see testbed/README.md):
//
//	nginx-web-server -> compose-post, home-timeline, user-timeline, user, social-graph
//	compose-post     -> text, user, media, unique-id (together), then post-storage,
//	                    user-timeline, home-timeline (together)
//	text             -> url-shorten, user-mention (together)
//	home-timeline    -> redis, social-graph, post-storage
//	user-timeline    -> redis, postgres (when redis has nothing), post-storage
//	post-storage     -> in-process cache, memcached, postgres on a miss
//	social-graph     -> redis, postgres on a miss, user (follow by name)
//	user             -> memcached, postgres, social-graph (register)
//	user-mention     -> memcached, postgres on a miss
//	url-shorten      -> postgres
package app

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"

	"bmeg.dev/testbed/internal/config"
	"bmeg.dev/testbed/internal/rpc"
	"bmeg.dev/testbed/internal/stores"
)

// Service describes one socialnet service.
type Service struct {
	Name     string
	Peers    []string // the services it calls
	Redis    bool
	Memcache bool
	Postgres bool
	Cache    bool     // it has an in-process cache sized by cache_items
	Schema   []string // statements creating its tables (idempotent)
	Register func(e *Env, s *rpc.Server)
}

// Env is what a service's handlers reach: its peers, its stores (replaced whole when db_pool
// changes), its in-process post cache.
type Env struct {
	Service  string
	Instance string
	Peers    *rpc.Client
	Posts    *stores.LRU[int64, Post]
	stores   atomic.Pointer[stores.Stores]
}

// Stores returns the service's stores as they are now.
func (e *Env) Stores() *stores.Stores { return e.stores.Load() }

// SetStores installs new stores and returns the old ones (nil at first).
func (e *Env) SetStores(s *stores.Stores) *stores.Stores { return e.stores.Swap(s) }

var services = map[string]Service{}

func register(s Service) { services[s.Name] = s }

func init() {
	for _, s := range []Service{nginx, composePost, text, urlShorten, userMention, uniqueID, media,
		user, socialGraph, postStorage, homeTimeline, userTimeline} {
		register(s)
	}
}

// Names lists the services, sorted.
func Names() []string {
	out := make([]string, 0, len(services))
	for n := range services {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Lookup returns the service called name.
func Lookup(name string) (Service, error) {
	s, ok := services[name]
	if !ok {
		return Service{}, fmt.Errorf("unknown service %q; the services are %v", name, Names())
	}
	return s, nil
}

// Check says which peers and stores a configuration lacks for the service.
func (s Service) Check(c *config.Config) error {
	var errs []error
	for _, p := range s.Peers {
		if c.Peers[p] == "" {
			errs = append(errs, fmt.Errorf("%s calls %s: add it to \"peers\"", s.Name, p))
		}
	}
	need := func(used bool, value, field string) {
		if used && value == "" {
			errs = append(errs, fmt.Errorf("%s uses %s: set %q", s.Name, field, field))
		}
	}
	need(s.Redis, c.Redis, "redis")
	need(s.Memcache, c.Memcached, "memcached")
	need(s.Postgres, c.Postgres, "postgres")
	return errors.Join(errs...)
}

// StoreSpec is the part of a configuration that says how to open the service's stores.
func (s Service) StoreSpec(c *config.Config) stores.Spec {
	spec := stores.Spec{Service: s.Name, Pool: c.DBPool}
	if s.Redis {
		spec.Redis, spec.RedisDB = c.Redis, c.RedisDB
	}
	if s.Memcache {
		spec.Memcached = c.Memcached
	}
	if s.Postgres {
		spec.Postgres = c.Postgres
	}
	return spec
}

// together runs calls concurrently, as DeathStarBench's services issue their fan-out, and
// returns their errors joined.
func together(calls ...func() error) error {
	errs := make([]error, len(calls))
	var wg sync.WaitGroup
	for i, call := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = call()
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// badRequest marks a caller's mistake.
func badRequest(format string, args ...any) error {
	return rpc.BadRequest{Err: fmt.Errorf(format, args...)}
}

// noStores is a health check for services without stores.
func noStores(context.Context) error { return nil }
