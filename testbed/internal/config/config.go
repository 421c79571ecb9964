// Package config reads a service's JSON configuration (see testbed/README.md, "Configuration").
//
// A configuration names the service, its listen address, the peers it calls (service name ->
// base URL, which may be a delay proxy in front of the peer), the stores it uses, and three
// tuning knobs that a runtime changes with SIGHUP: workers (concurrent requests handled),
// db_pool (store connection pool size) and cache_items (in-process cache capacity).
package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// Config is one service's configuration file.
type Config struct {
	Service      string            `json:"service"`
	Listen       string            `json:"listen"`
	Instance     string            `json:"instance,omitempty"`
	Peers        map[string]string `json:"peers,omitempty"`
	Redis        string            `json:"redis,omitempty"`
	RedisDB      int               `json:"redis_db,omitempty"`
	Memcached    string            `json:"memcached,omitempty"`
	Postgres     string            `json:"postgres,omitempty"`
	Workers      int               `json:"workers,omitempty"`
	QueueLimit   int               `json:"queue_limit,omitempty"`
	DBPool       int               `json:"db_pool,omitempty"`
	CacheItems   int               `json:"cache_items,omitempty"`
	OTLPEndpoint string            `json:"otlp_endpoint,omitempty"`
}

// Defaults for knobs a configuration leaves out.
const (
	DefaultWorkers    = 64
	DefaultQueueLimit = 4096
	DefaultDBPool     = 8
	DefaultCacheItems = 10000
)

// Load reads and validates the configuration at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return Parse(data, path)
}

// Parse decodes a configuration document; source names it in errors.
func Parse(data []byte, source string) (*Config, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields() // a misspelt knob must not be silently ignored
	var c Config
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("config %s: %w", source, err)
	}
	c.applyDefaults()
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("config %s: %w", source, err)
	}
	return &c, nil
}

func (c *Config) applyDefaults() {
	if c.Workers == 0 {
		c.Workers = DefaultWorkers
	}
	if c.QueueLimit == 0 {
		c.QueueLimit = DefaultQueueLimit
	}
	if c.DBPool == 0 {
		c.DBPool = DefaultDBPool
	}
	if c.CacheItems == 0 {
		c.CacheItems = DefaultCacheItems
	}
	if c.Instance == "" {
		c.Instance = c.Service + "@" + c.Listen
	}
}

// Validate checks the fields that every service needs; which stores and peers a service
// needs is checked by the service itself (app.Requirements).
func (c *Config) Validate() error {
	var errs []error
	if c.Service == "" {
		errs = append(errs, errors.New(`"service" is required`))
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		errs = append(errs, fmt.Errorf(`"listen" must be host:port, got %q`, c.Listen))
	}
	for name, v := range map[string]int{"workers": c.Workers, "queue_limit": c.QueueLimit,
		"db_pool": c.DBPool, "cache_items": c.CacheItems} {
		if v < 1 {
			errs = append(errs, fmt.Errorf("%q must be >= 1, got %d", name, v))
		}
	}
	if c.RedisDB < 0 || c.RedisDB > 15 {
		errs = append(errs, fmt.Errorf(`"redis_db" must be 0..15, got %d`, c.RedisDB))
	}
	for name, url := range c.Peers {
		if !strings.HasPrefix(url, "http://") {
			errs = append(errs, fmt.Errorf("peer %q: URL must start with http://, got %q", name, url))
		}
	}
	return errors.Join(errs...)
}
